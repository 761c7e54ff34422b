"""The pure path from captured traces to the loss: training rows (:mod:`.rows`), a group's records and its
rewards (:mod:`.groups`, :mod:`.outcome`), group-relative advantages (:mod:`.advantages`), one step's batch
(:mod:`.batch`, :mod:`.timesplit`), padding-free packing (:mod:`.packing`), per-token logprobs
(:mod:`.logprobs`, :mod:`.shared_prefix`) and the policy loss (:mod:`.loss`).

Nothing here starts a server, a session or a process; each module is tested on hand-built inputs.
"""
