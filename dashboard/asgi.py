"""ASGI entry point served by daphne: HTTP through Django, websockets through Channels."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402

from dashboard.limits import ApiRequest, BodyLimit  # noqa: E402

# Static files (htmx, CSS, the admin's) come from the app itself: `hangar up` needs no separate
# web server or collectstatic step. A deployment behind nginx can serve STATIC_ROOT instead.
django_app = ASGIStaticFilesHandler(get_asgi_application())


class ApiHandler(ASGIHandler):
    """Django for /api/ and /e2b/ (E2B's API, :mod:`dashboard.e2b`) alone, with
    ``HANGAR_API_MIDDLEWARE``: the APIs authenticate by token and set no cookies, so the
    dashboard's session, CSRF, login and messages middleware have nothing to do there, and
    under ASGI each of them is a hop to a thread and back (about 0.7 ms a request here). Security headers and the audit actor stay. Bodies are held
    to their route's limit before Django reads them (``dashboard.limits``)."""

    request_class = ApiRequest

    def load_middleware(self, is_async: bool = False) -> None:
        # Django reads the list from settings.MIDDLEWARE; swapped for this one call, at import,
        # before any request is served.
        dashboard_middleware = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.HANGAR_API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = dashboard_middleware


api_app = BodyLimit(ApiHandler())
API_PATHS = ("/api/", "/e2b/", "/v1/")  # /v1/: OTLP's paths at the root (dashboard/otlp.py)


from dashboard.mcp.server import app as mcp_app  # noqa: E402


async def http_app(scope, receive, send):
    path = scope["path"]
    if path == "/mcp" or path.startswith("/mcp/"):  # MCP over streamable HTTP (dashboard.mcp)
        return await mcp_app(scope, receive, send)
    app = api_app if path.startswith(API_PATHS) else django_app
    return await app(scope, receive, send)


from dashboard.edge.preview import PreviewRouter  # noqa: E402
from dashboard.websockets.routing import websocket_urlpatterns  # noqa: E402
from dashboard.websockets.ws_auth import HangarAuthStack  # noqa: E402

# Preview URLs ({port}-{sandbox}.{HANGAR_PREVIEW_DOMAIN}) are picked by their Host first.
application = PreviewRouter(
    ProtocolTypeRouter({"http": http_app, "websocket": HangarAuthStack(URLRouter(websocket_urlpatterns))})
)
