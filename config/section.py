"""What every part of the settings shares: read from `BALLAST_*` environment variables."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class Section(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BALLAST_", extra="ignore")
