"""Worked example 2 of docs/policy-examples.md: `refund_payment`, two approvers above 500.

`toolgate up --example refund` runs the gateway with this example beside the
built-in tools: the tool in `registry/` (its function in refund.py, a ledger
of its own under the data dir), the agent identity `acme.support`, and the
example's policy bundle, written to `<data-dir>/examples/refund/policy/`
(the default bundle plus `infra/policies/examples/refund_payment.cedar`, both
read from the installed package), which the policy service starts with. In
a data dir where another bundle was pushed, `toolgate up --example refund`
pushes this one over it as the next version (stack/supervisor.py
settle_policy), and says which version it replaced.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

REGISTRY_DIR = Path(str(resources.files(__name__) / "registry"))
# The example's bundle, relative: under the gateway's data dir (prepare() writes it).
BUNDLE = Path("examples") / "refund" / "policy"
POLICY_DIR = BUNDLE
# The policies of toolgate.infra.policies/examples/ this example adds to the default bundle.
POLICIES = ("refund_payment.cedar",)
# The identities `toolgate up --example refund` mints: the only agent the policy lets refund.
AGENTS = (("acme", "support"),)
TRY = (
    'toolgate call refund_payment \'{"payment_id": "pay_1001", "amount": 900}\' '
    "--user u-carol --timeout 900"
)


def bundle_path(data_dir: Path) -> Path:
    return Path(data_dir) / BUNDLE


def bundle_files() -> dict[str, str]:
    """The example's bundle: the default bundle's files plus POLICIES, as shipped."""
    policies = resources.files("toolgate.infra.policies")
    files = {
        entry.name: entry.read_text(encoding="utf-8")
        for entry in (policies / "default").iterdir()
        if entry.is_file() and _is_bundle_file(entry.name)
    }
    for name in POLICIES:
        files[name] = (policies / "examples" / name).read_text(encoding="utf-8")
    return files


def _is_bundle_file(name: str) -> bool:  # as toolgate.services.policy.bundle reads a bundle
    return name in ("schema.cedarschema", "bundle.yaml") or name.endswith(".cedar")


def prepare(data_dir: Path) -> Path:
    """Write the example's bundle under the data dir (a file already there is kept: it may
    have been changed on purpose); its directory."""
    target = bundle_path(data_dir)
    target.mkdir(parents=True, exist_ok=True)
    for name, text in bundle_files().items():
        path = target / name
        if not path.exists():
            path.write_text(text, encoding="utf-8")
    return target
