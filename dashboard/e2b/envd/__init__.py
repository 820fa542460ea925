"""E2B's in-sandbox API (envd), served at /e2b/envd (``E2B_SANDBOX_URL``) for every sandbox,
which the SDK names in ``E2b-Sandbox-Id``: ``protocol`` speaks Connect and checks the access
token, ``process`` and ``filesystem`` are its two services, ``files`` its plain HTTP routes,
``views`` routes them. Message shapes follow E2B's published protos (docs/e2b.md)."""
