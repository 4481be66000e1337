"""Optional sinks are checked before anything is written: W&B needs credentials, or a mode
that needs none."""

from __future__ import annotations

import pytest

from forge.metrics.backends import WANDB_HOST, wandb_credentials_problem

NETRC = f"machine {WANDB_HOST}\n  login user\n  password 0123456789abcdef\n"

# (case, environment, netrc text or None, refused)
CASES = [
    ("no key, no login", {}, None, True),
    ("a netrc without W&B", {}, "machine example.org login a password b\n", True),
    ("an API key", {"WANDB_API_KEY": "k"}, None, False),
    ("wandb login", {}, NETRC, False),
    ("offline", {"WANDB_MODE": "offline"}, None, False),
    ("disabled", {"WANDB_MODE": "disabled"}, None, False),
    ("online asked, no key", {"WANDB_MODE": "online"}, None, True),
    (
        "a self-hosted server's login",
        {"WANDB_BASE_URL": "https://wandb.example.org"},
        "machine wandb.example.org login u password p\n",
        False,
    ),
    (
        "W&B's login, a self-hosted server",
        {"WANDB_BASE_URL": "https://wandb.example.org"},
        NETRC,
        True,
    ),
]


@pytest.mark.parametrize(
    ("env", "netrc", "refused"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_wandb_needs_credentials_or_an_offline_mode(tmp_path, env, netrc, refused):
    path = tmp_path / ".netrc"
    if netrc is not None:
        path.write_text(netrc)
    problem = wandb_credentials_problem(env, path)
    assert (problem is not None) is refused
    if refused:
        assert (
            problem.startswith("metrics.wandb: no W&B credentials")
            and "WANDB_MODE=offline" in problem
        )
