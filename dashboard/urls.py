from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path

from dashboard import otlp
from dashboard.api import api
from dashboard.e2b.api import api as e2b_api
from dashboard.e2b.unsupported import unsupported as e2b_unsupported
from dashboard.pages import harness_views, node_views, sandbox_views, team_views, trace_views, views
from dashboard.signin import SignInView, ThrottledAdminAuthenticationForm

admin.site.login_form = ThrottledAdminAuthenticationForm

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/traces", otlp.traces, name="otlp_traces"),
    path("v1/logs", otlp.logs, name="otlp_logs"),
    path("api/v1/otlp/v1/traces", otlp.traces),
    path("api/v1/otlp/v1/logs", otlp.logs),
    path("api/v1/", api.urls),
    path("e2b/envd/", include("dashboard.e2b.envd.views")),
    path("e2b/", e2b_api.urls),
    re_path(r"^e2b/(?P<rest>.*)$", e2b_unsupported),
    path("login/", SignInView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("team/", views.team_switch, name="team_switch"),
    path("sandboxes/", sandbox_views.sandboxes, name="sandboxes"),
    path("sandboxes/<str:sandbox_id>/", sandbox_views.sandbox_detail, name="sandbox"),
    path("sandboxes/<str:sandbox_id>/stop/", sandbox_views.sandbox_stop, name="sandbox_stop"),
    path("sandboxes/<str:sandbox_id>/pause/", sandbox_views.sandbox_pause, name="sandbox_pause"),
    path("sandboxes/<str:sandbox_id>/resume/", sandbox_views.sandbox_resume, name="sandbox_resume"),
    path("sandboxes/<str:sandbox_id>/delete/", sandbox_views.sandbox_delete, name="sandbox_delete"),
    path("sandboxes/<str:sandbox_id>/keepalive/", sandbox_views.sandbox_keepalive, name="sandbox_keepalive"),
    path("sandboxes/<str:sandbox_id>/terminals/", sandbox_views.terminal_create, name="terminal_create"),
    path("sandboxes/<str:sandbox_id>/commands/", sandbox_views.command_run, name="command_run"),
    path("sandboxes/<str:sandbox_id>/files/download", sandbox_views.file_download, name="file_download"),
    path("sandboxes/<str:sandbox_id>/files/upload", sandbox_views.file_upload, name="file_upload"),
    path("harnesses/", harness_views.harnesses, name="harnesses"),
    path("harnesses/new/image/", harness_views.harness_image_build, name="harness_image_build"),
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
    path("traces/", trace_views.traces, name="traces"),
    path("traces/<str:trace_id>/", trace_views.trace_detail, name="trace"),
    path("traces/<str:trace_id>/spans/<str:span_id>/", trace_views.trace_span, name="trace_span"),
    path("nodes/", node_views.nodes, name="nodes"),
    path("nodes/join-tokens/", node_views.join_token_create, name="node_join_token"),
    path("nodes/<str:name>/<str:action>/", node_views.node_action, name="node_action"),
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

# A service underneath away (the database, Redis) is a 503 that says so, not a bare 500.
handler500 = "dashboard.unavailable.server_error"
