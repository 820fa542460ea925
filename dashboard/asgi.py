"""ASGI entry point served by daphne: HTTP through Django, websockets through Channels."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

# Static files (htmx, CSS, the admin's) come from the app itself: `hangar up` needs no separate
# web server or collectstatic step. A deployment behind nginx can serve STATIC_ROOT instead.
django_app = ASGIStaticFilesHandler(get_asgi_application())

from dashboard.preview import PreviewRouter  # noqa: E402
from dashboard.routing import websocket_urlpatterns  # noqa: E402
from dashboard.ws_auth import HangarAuthStack  # noqa: E402

# Preview URLs ({port}-{sandbox}.{HANGAR_PREVIEW_DOMAIN}) are picked by their Host first.
application = PreviewRouter(
    ProtocolTypeRouter({"http": django_app, "websocket": HangarAuthStack(URLRouter(websocket_urlpatterns))})
)
