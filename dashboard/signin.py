"""Signing in with a password, throttled (``runtime.services.login_throttle``): the sign-in
page, the admin's, and anything else that calls ``authenticate`` with a password go through
the same backend, so none of them is an unthrottled way around the others."""

from __future__ import annotations

import math
from typing import Any

from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse

from runtime.services.login_throttle import login_failed, login_succeeded, login_wait_s


def _address(request: HttpRequest | None) -> str:
    return (request.META.get("REMOTE_ADDR") if request is not None else "") or "unknown"


def _wait_message(wait: float) -> str:
    return (f"Too many failed sign-ins for this account or from this address: try again in "
            f"{math.ceil(wait)} s.")  # fmt: skip


class ThrottledModelBackend(ModelBackend):
    """Django's own check of user names and passwords, refused outright while the account or
    the address must wait, and counting every failure."""

    def authenticate(self, request: HttpRequest | None, username: str | None = None, password: str | None = None,
                     **kwargs: Any) -> Any:  # fmt: skip
        name = username or kwargs.get("username") or ""
        if login_wait_s(username=name, address=_address(request)) > 0:
            raise PermissionDenied("sign-in throttled")  # stops every backend: no password is checked
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            login_failed(username=name, address=_address(request))
        else:
            login_succeeded(username=name)
        return user


class _Throttled:
    """Says why a sign-in is refused while it must wait, instead of "wrong password"."""

    throttled_for = 0.0

    def clean(self) -> dict[str, Any]:
        name = self.data.get("username") or ""  # type: ignore[attr-defined]
        wait = login_wait_s(username=name, address=_address(self.request))  # type: ignore[attr-defined]
        if wait > 0:
            self.throttled_for = wait
            raise ValidationError(_wait_message(wait), code="throttled")
        return super().clean()  # type: ignore[misc]


class ThrottledAuthenticationForm(_Throttled, AuthenticationForm):
    pass


class ThrottledAdminAuthenticationForm(_Throttled, AdminAuthenticationForm):
    pass


class SignInView(LoginView):
    template_name = "hangar/login.html"
    redirect_authenticated_user = True
    authentication_form = ThrottledAuthenticationForm

    def form_invalid(self, form: Any) -> HttpResponse:
        response = super().form_invalid(form)
        if getattr(form, "throttled_for", 0) > 0:
            response.status_code = 429
            response["Retry-After"] = str(math.ceil(form.throttled_for))
        return response
