"""Websocket routes (terminals and streaming exec arrive with the dashboard issue)."""

from django.urls import URLPattern

websocket_urlpatterns: list[URLPattern] = []
