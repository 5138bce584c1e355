"""Webhooks: where tenants' completion events may go, and how their delivery is retried."""

from __future__ import annotations

from pydantic import Field

from config.section import Section


class WebhookSettings(Section):
    # Endpoints a tenant may register at once (POST /v1/webhooks refuses one more with a 409).
    max_webhooks_per_tenant: int = Field(10, ge=1)

    # A delivery that does not get a 2xx is retried with exponential backoff (×2) from
    # webhook_retry_initial_s up to webhook_retry_max_interval_s between attempts, until
    # webhook_give_up_after_s after the first; each attempt waits webhook_timeout_s at most
    # for the receiver's response. Read by the control worker, when an event is raised.
    webhook_retry_initial_s: float = Field(1.0, gt=0)
    webhook_retry_max_interval_s: float = Field(300.0, gt=0)
    webhook_give_up_after_s: float = Field(3 * 86400.0, gt=0)
    webhook_timeout_s: float = Field(10.0, gt=0)

    # Networks no delivery connects to, comma-separated CIDRs, checked against every address
    # the endpoint's host resolves to at each attempt (the connection goes to the address
    # checked): by default link-local (cloud metadata services) and unspecified addresses.
    # A deployment whose tenants must not reach its private networks adds them
    # (10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,127.0.0.0/8,::1/128,fc00::/7).
    webhook_denied_networks: str = "169.254.0.0/16,fe80::/10,0.0.0.0/8,::/128"
