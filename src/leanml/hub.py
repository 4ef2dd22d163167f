"""The model and dataset hub, without a request: whether offline mode is asked for, and whether the hub answers."""

from __future__ import annotations

import os


def hub_offline() -> bool:
    """Whether the environment asks for offline mode (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub answers a TCP connection within ``timeout`` seconds (no request is sent)."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        url = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001 - no hub client: nothing to reach
        return False
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False
