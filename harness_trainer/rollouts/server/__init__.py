"""The rollout server's side of the wire: ``routes`` (``harness-trainer serve``), the ``runtime`` it shares
with the in-process factory, one rollout from start to finish (``run``, with the task's ``verifier``), and
its capture proxy (``capture_client``, ``proxy_process``)."""
