"""vLLM's own plug points: the plugin that registers the ``deltasync`` backend in every vLLM process, and the
trainer-side engine for code that drives vLLM's weight-transfer trainer API.

- :mod:`.plugin`: the ``vllm.general_plugins`` entry point (installing deltasync is all a server needs).
- :mod:`.trainer`: :class:`DeltaSyncTrainerEngine`, vLLM's ``WeightTransferTrainerFactory`` backend
  ``deltasync``: ``send_weights`` publishes a version and drives the server's round trip.

The worker side of the backend is a replica's: :mod:`deltasync.appliers.vllm.backend`.
"""
