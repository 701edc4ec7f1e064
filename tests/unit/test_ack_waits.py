"""Each durable holds a delivery as long as its stage needs, not JetStream's 30 s default."""

from __future__ import annotations

from toolgate.runtime import consumers
from toolgate.runtime.topology import (
    AUDIT_ACK_WAIT_S,
    DEFAULT_ACK_WAIT_S,
    EXECUTOR_ACK_MARGIN_S,
    EXECUTOR_ACK_WAIT_CAP_S,
    NOTIFIER_ACK_WAIT_S,
    NOTIFIER_DELIVERIES_DURABLE,
    executor_ack_wait,
    handlers,
    heartbeat_interval,
    stage_ack_wait,
)


class TestStageAckWait:
    def test_the_quick_stages_are_redelivered_well_before_the_default(self) -> None:
        quick = [
            h.durable
            for h in handlers(["echo"])
            if h.service != "executor" and h.durable != NOTIFIER_DELIVERIES_DURABLE
        ]
        assert quick  # validator, policy, approvals, attacher-*, the notifier's fan-out
        assert all(stage_ack_wait(durable) < DEFAULT_ACK_WAIT_S for durable in quick)

    def test_a_webhook_delivery_is_held_longer_than_one_attempt(self) -> None:
        # One attempt may take its whole timeout (services/notifier: 10 s by default).
        assert stage_ack_wait(NOTIFIER_DELIVERIES_DURABLE) == NOTIFIER_ACK_WAIT_S > 10.0

    def test_the_audit_keeps_room_for_a_batch(self) -> None:
        # A batch fills for about a second; the sink says in_progress while it waits.
        assert stage_ack_wait("audit") == AUDIT_ACK_WAIT_S >= 3 * 1.0

    def test_the_sink_creates_its_durables_with_the_topology_value(self) -> None:
        # One value: the table said 30 s while the sink created its durables with 10 s.
        from toolgate.services.audit import app as audit_app

        assert audit_app.ACK_WAIT_S == stage_ack_wait("audit")

    def test_consumer_config_takes_the_stage_value_unless_told(self) -> None:
        assert consumers.consumer_config("validator", "x.>").ack_wait == stage_ack_wait("validator")
        assert consumers.consumer_config("audit", "x.>", ack_wait_s=7.0).ack_wait == 7.0


class TestExecutorAckWait:
    def test_a_quick_tool_waits_its_timeout_plus_a_margin(self) -> None:
        assert executor_ack_wait(2.0) == 2.0 + EXECUTOR_ACK_MARGIN_S

    def test_a_long_tool_is_capped_and_kept_alive_by_heartbeats(self) -> None:
        wait = executor_ack_wait(600.0)
        assert wait == EXECUTOR_ACK_WAIT_CAP_S < DEFAULT_ACK_WAIT_S
        # Several heartbeats fit in one AckWait: one lost beat does not redeliver, and a
        # message is kept (two beats at most after its hand-over) within a third of it.
        assert heartbeat_interval(wait) * 2 <= wait / 3
