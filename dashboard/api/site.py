"""Site-wide defaults (site administrators): the quotas every team gets unless its ceiling
says otherwise, and the cost rates."""

from __future__ import annotations

from django.http import HttpRequest
from ninja import Body, Router
from pydantic import StrictFloat, StrictInt

from runtime.services import quotas as quota_svc
from runtime.services import usage as usage_svc

from .blocking import blocking

router = Router(tags=["site"])


@router.get("/quotas", response=dict[str, float])
async def get_site_quotas(request: HttpRequest):
    return await blocking(quota_svc.site_defaults)()


@router.put("/quotas", response=dict[str, float])
async def set_site_quotas(request: HttpRequest, payload: Body[dict[str, StrictInt | StrictFloat | None]]):
    """`{"sandboxes": 20, …}` (null: back to the setting's value)."""
    return await blocking(lambda: quota_svc.site_defaults_set(values=payload))()


@router.get("/rates", response=dict[str, float])
async def get_site_rates(request: HttpRequest):
    return await blocking(lambda: usage_svc.site_rates())()


@router.put("/rates", response=dict[str, float])
async def set_site_rates(request: HttpRequest, payload: Body[dict[str, StrictFloat | None]]):
    """`{"vcpu_hour": 0.05, "memory_gb_hour": 0.01, "storage_gb_hour": 0.0001, "gpu_hour": 2}`."""
    return await blocking(lambda: usage_svc.rates_set(team=None, values=payload))()
