"""Which webhooks hear which tenants' approvals: the configuration, read once at start.

The operator's file (`toolgate up --approval-webhooks FILE`, default
`DATA_DIR/approval-webhooks.yaml` when it exists):

    webhooks:
      - url: https://hooks.slack.com/services/T000/B000/XXXX
        tenants: [acme]                # left out: every tenant's calls
        secret_file: acme-hook.secret  # relative to this file; default: the
                                       # --approval-webhook-secret-file of `toolgate up`
        events: [waiting, reminder, decided, expired]   # the default: all four

Each `toolgate up --approval-webhook URL` is one more entry with every tenant
and the default secret. `toolgate up` writes the merged list, each entry with
an absolute `secret_file`, to `DATA_DIR/notifier/webhooks.yaml` (mode 0600: the
URLs are credentials too) and starts `toolgate serve notifier --webhooks` on
it; the notifier reads each secret file once and keeps the secret in memory
only. Neither a URL nor a secret is ever logged, put in an event or a metric:
a webhook is named by its id (`logic.webhook_id`) and host.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from toolgate.contracts import subjects
from toolgate.services.notifier.logic import KINDS, Kind, Webhook

CONFIG_FILE = "approval-webhooks.yaml"
RESOLVED_FILE = Path("notifier") / "webhooks.yaml"
DEFAULT_SECRET_FILE = "approval-webhook.secret"
MAX_SECRET_BYTES = 4096


class WebhookConfigError(ValueError):
    """The webhook configuration cannot be used; the message says where and why."""


class WebhookEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(min_length=8, max_length=2048)
    tenants: list[str] | None = None
    secret_file: Path | None = None
    events: list[Kind] = list(KINDS)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")) or any(c.isspace() for c in value):
            raise ValueError("an http:// or https:// URL")
        return value

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, value: list[str] | None) -> list[str] | None:
        for tenant in value or []:
            if not subjects.is_identity_token(tenant):
                raise ValueError(f"not a tenant name: {tenant!r}")
        return value


class WebhooksFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    webhooks: list[WebhookEntry] = []


def _problem(path: Path, exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{path}: {where}: {first['msg']}"


def read_config(path: Path) -> list[WebhookEntry]:
    """The entries of a webhooks file, each `secret_file` made absolute (relative paths
    are relative to the file)."""
    try:
        raw: Any = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise WebhookConfigError(f"{path}: cannot read: {exc}") from None
    try:
        document = WebhooksFile.model_validate(raw)
    except ValidationError as exc:
        raise WebhookConfigError(_problem(path, exc)) from None
    return [
        entry.model_copy(update={"secret_file": (path.parent / entry.secret_file).resolve()})
        if entry.secret_file is not None
        else entry
        for entry in document.webhooks
    ]


def merged(
    urls: list[str], secret_file: Path | None, entries: list[WebhookEntry]
) -> list[WebhookEntry]:
    """`toolgate up`'s webhooks: every --approval-webhook URL (every tenant), then the
    file's entries; entries without a secret file get `secret_file`."""
    try:
        given = [WebhookEntry(url=url) for url in urls]
    except ValidationError as exc:
        raise WebhookConfigError(f"--approval-webhook: {exc.errors()[0]['msg']}") from None
    default = secret_file.resolve() if secret_file is not None else None
    return [
        entry
        if entry.secret_file is not None
        else entry.model_copy(update={"secret_file": default})
        for entry in [*given, *entries]
    ]


def check_secret_file(path: Path | None, what: str) -> None:
    """A secret file a notifier could read (checked without reading it: it is read once,
    by the notifier)."""
    if path is None:
        raise WebhookConfigError(f"{what}: no secret file to sign with")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise WebhookConfigError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
    if not path.is_file() or not os.access(path, os.R_OK):
        raise WebhookConfigError(f"{what}: {path} is not a readable file")
    if size == 0 or size > MAX_SECRET_BYTES:
        raise WebhookConfigError(f"{what}: {path} must hold a secret of 1 to 4096 bytes")


def write_resolved(path: Path, entries: list[WebhookEntry]) -> None:
    """The merged list, for the notifier (mode 0600: webhook URLs are credentials)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"webhooks": [entry.model_dump(mode="json", exclude_none=True) for entry in entries]}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(document, handle, sort_keys=False)
    tmp.replace(path)


def load_webhooks(path: Path | None) -> list[Webhook]:
    """The notifier's webhooks, each secret read now and only now (None: no webhooks)."""
    if path is None:
        return []
    secrets: dict[Path, bytes] = {}
    found: dict[str, Webhook] = {}
    for number, entry in enumerate(read_config(path)):
        what = f"{path}: webhook {number + 1}"
        check_secret_file(entry.secret_file, what)
        assert entry.secret_file is not None
        if entry.secret_file not in secrets:
            secret = entry.secret_file.read_bytes().strip()
            if not secret:
                raise WebhookConfigError(f"{what}: {entry.secret_file} holds only blanks")
            secrets[entry.secret_file] = secret
        webhook = Webhook(
            url=entry.url,
            secret=secrets[entry.secret_file],
            tenants=frozenset(entry.tenants) if entry.tenants is not None else None,
            events=frozenset(entry.events),
        )
        if webhook.id in found:
            raise WebhookConfigError(
                f"{what}: the same URL as an earlier webhook (id {webhook.id}); give it "
                "once, with every tenant it serves"
            )
        found[webhook.id] = webhook
    return list(found.values())


def ensure_default_secret(data_dir: Path) -> Path:
    """DATA_DIR/approval-webhook.secret, made once (32 random bytes, hex, mode 0600):
    the secret `toolgate up` signs with when given none. Give it to the receivers."""
    path = data_dir / DEFAULT_SECRET_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(os.urandom(32).hex() + "\n")
    return path
