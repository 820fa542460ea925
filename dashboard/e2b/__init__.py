"""E2B's control-plane REST API, served at /e2b, so code written for the unmodified ``e2b`` SDK
runs on Hangar's sandboxes (docs/e2b.md): ``api`` assembles it, ``sandboxes`` holds its
endpoints, ``schemas`` the shapes E2B's generated client requires, ``auth`` the key check."""
