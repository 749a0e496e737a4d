"""Scheduling policies: the objects a Scheduler asks whom to admit and whom to preempt
(`--scheduling-policy`): fcfs (policies/base.py), fair, priority and static batching."""

from __future__ import annotations

from llmserve.scheduler.policies.base import FcfsPolicy, Policy
from llmserve.scheduler.policies.fair import FairPolicy
from llmserve.scheduler.policies.priority import PriorityPolicy
from llmserve.scheduler.policies.static_batching import StaticBatching

POLICIES: dict[str, type[Policy]] = {
    "fcfs": FcfsPolicy,
    "fair": FairPolicy,
    "priority": PriorityPolicy,
    "static": StaticBatching,
}


def make_policy(name: str) -> Policy:
    """The policy called name (SchedulerConfig.policy: a name of POLICIES)."""
    return POLICIES[name]()
