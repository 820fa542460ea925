from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path

from dashboard import harness_views, team_views, views
from dashboard.api import api

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="hangar/login.html", redirect_authenticated_user=True),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("team/", views.team_switch, name="team_switch"),
    path("sandboxes/", views.sandboxes, name="sandboxes"),
    path("sandboxes/<str:sandbox_id>/", views.sandbox_detail, name="sandbox"),
    path("sandboxes/<str:sandbox_id>/stop/", views.sandbox_stop, name="sandbox_stop"),
    path("sandboxes/<str:sandbox_id>/pause/", views.sandbox_pause, name="sandbox_pause"),
    path("sandboxes/<str:sandbox_id>/resume/", views.sandbox_resume, name="sandbox_resume"),
    path("sandboxes/<str:sandbox_id>/delete/", views.sandbox_delete, name="sandbox_delete"),
    path("sandboxes/<str:sandbox_id>/keepalive/", views.sandbox_keepalive, name="sandbox_keepalive"),
    path("sandboxes/<str:sandbox_id>/terminals/", views.terminal_create, name="terminal_create"),
    path("sandboxes/<str:sandbox_id>/commands/", views.command_run, name="command_run"),
    path("sandboxes/<str:sandbox_id>/files/download", views.file_download, name="file_download"),
    path("sandboxes/<str:sandbox_id>/files/upload", views.file_upload, name="file_upload"),
    path("harnesses/", harness_views.harnesses, name="harnesses"),
    path("harnesses/<str:harness_id>/", harness_views.harness_detail, name="harness"),
    path("harnesses/<str:harness_id>/log/", harness_views.harness_log, name="harness_log"),
    path("harnesses/<str:harness_id>/pause/", harness_views.harness_pause, name="harness_pause"),
    path("harnesses/<str:harness_id>/resume/", harness_views.harness_resume, name="harness_resume"),
    path("harnesses/<str:harness_id>/delete/", harness_views.harness_delete, name="harness_delete"),
    path("harnesses/<str:harness_id>/terminals/", harness_views.harness_terminal, name="harness_terminal"),
    path("harnesses/<str:harness_id>/runs/", harness_views.harness_run, name="harness_run"),
    path("runs/<str:run_id>/", harness_views.run_detail, name="run"),
    path("runs/<str:run_id>/cancel/", harness_views.run_cancel, name="run_cancel"),
    path("profile/", harness_views.profile, name="profile"),
    path("images/", views.images, name="images"),
    path("volumes/", views.volumes, name="volumes"),
    path("images/jobs/<int:job_id>/", views.image_job, name="image_job"),
    path("team/settings/", team_views.team_page, name="team"),
    path("usage/", team_views.usage_page, name="usage"),
    path("usage/<int:team_id>.csv", team_views.usage_csv, name="usage_csv"),
    path("audit/", team_views.audit_page, name="audit"),
    path("audit.csv", team_views.audit_csv, name="audit_csv"),
    path("invite/<str:code>/", team_views.invitation, name="invitation"),
    path("", views.overview, name="overview"),
]
