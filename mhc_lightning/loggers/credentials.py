"""Secrets in MLflow tracking URIs (`http://user:secret@host:5000`) stay out of every output, artifact and child command
line.

MLflow's client sends HTTP basic auth from MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD. So the entry points
(`mhc`, `mhc sweep`, `mhc compare`, a fit's logger config) move the user and password of an http(s) tracking URI into
those variables (`take_credentials`) and carry on with the bare URI: that is what gets printed, written to
`config.yaml` and `trial_command.txt`, passed on command lines and tagged, while child processes inherit the
credentials with the environment (readable only by the same user, unlike argv in `ps`). A URI whose credentials MLflow
cannot take from the environment (a database URL as the tracking store) is masked wherever it is shown (`mask`).
"""

from __future__ import annotations

import os
import re
from typing import Optional
from urllib.parse import unquote, urlsplit, urlunsplit

USER_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
URI_ENV = "MLFLOW_TRACKING_URI"
# user:password@ after a scheme's //, within one token (text may hold several URLs and other '@'s)
_USERINFO = re.compile(r"(//[^:/@\s'\"]+:)[^@/\s'\"]*@")
# a secret passed as a URL query parameter (`postgresql://host/db?password=...`, `?token=...`)
_QUERY_SECRET = re.compile(
    r"([?&;](?:password|passwd|pwd|secret|token|access_token|api_key|apikey)=)[^&;#\s'\"]*", re.IGNORECASE
)


def mask(text: str) -> str:
    """Every `//user:password@` in `text` as `//user:***@`, and every password-like query parameter as `...=***`."""
    return _QUERY_SECRET.sub(r"\1***", _USERINFO.sub(r"\1***@", str(text)))


def split_credentials(uri: str) -> tuple[str, Optional[str], Optional[str]]:
    """(URI without user and password, user, password) for http(s) URIs; other URIs come back unchanged."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, sep, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), unquote(user) or None, unquote(password) if sep else None


def take_credentials(uri: Optional[str]) -> Optional[str]:
    """`uri` without its user and password, which go to MLFLOW_TRACKING_USERNAME / _PASSWORD of this process (and so
    of every child it starts)."""
    if not uri:
        return uri
    bare, user, password = split_credentials(uri)
    if user is not None:
        os.environ[USER_ENV] = user
    if password is not None:
        os.environ[PASSWORD_ENV] = password
    return bare


def basic_auth() -> Optional[tuple[str, str]]:
    """(user, password) from MLflow's credential variables, for requests made outside MLflow's client."""
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    return (user, password) if user and password is not None else None


def clean_tracking_env() -> None:
    """MLFLOW_TRACKING_URI of this process without credentials (conf/base.yaml interpolates it into every fit's
    config, and children inherit it)."""
    uri = os.environ.get(URI_ENV)
    if uri:
        os.environ[URI_ENV] = take_credentials(uri)
