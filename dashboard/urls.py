from django.contrib import admin
from django.urls import path

from dashboard import views
from dashboard.api import api

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("", views.overview, name="overview"),
]
