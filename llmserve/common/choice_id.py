"""Choice ids: an HTTP request of n choices sends n Submits named `{request_id}-{index}`
(gateway/choices.py); an operator names them all by the request id. The gateway and the scheduler
both find a request's choices by this one rule."""

from __future__ import annotations


def names_request(request_id: str, name: str) -> bool:
    """Whether name is request_id itself or one of its choices' ids (`{request_id}-{index}`,
    index a decimal number)."""
    if name == request_id:
        return True
    prefix_len = len(request_id) + 1
    return name.startswith(request_id + "-") and name[prefix_len:].isdigit()
