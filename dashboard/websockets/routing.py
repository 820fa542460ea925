"""Websocket routes: the API's (token or session) and the dashboard pages' (session)."""

from django.urls import path

from . import consumers, trace_live

websocket_urlpatterns = [
    path("ws/v1/terminals/<str:terminal_id>", consumers.TerminalConsumer.as_asgi()),
    path("ws/v1/sandboxes/<str:sandbox_id>/exec", consumers.ExecConsumer.as_asgi()),
    path("ws/ui/sandboxes", consumers.SandboxesLiveConsumer.as_asgi()),
    path("ws/ui/sandboxes/<str:sandbox_id>", consumers.SandboxLiveConsumer.as_asgi()),
    path("ws/ui/images", consumers.ImagesLiveConsumer.as_asgi()),
    path("ws/ui/images/jobs/<int:job_id>", consumers.ImageJobLiveConsumer.as_asgi()),
    path("ws/ui/traces/<str:trace_id>", trace_live.TraceLiveConsumer.as_asgi()),
]
