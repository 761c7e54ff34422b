"""The trainer's side of the rollout wire: session factories and their sessions (OpenEnv's protocol).

``factory.HarborSessionFactory`` talks to a rollout server over HTTP; ``local_factory.LocalSessionFactory``
runs the server's runtime in process; ``session`` holds what both hand the trainer.
``whitebox_session.WhiteBoxSessionFactory`` makes white-box sessions on a server (OpenEnv's
``ResourceSession``: the trainer samples, the server's sandbox runs the tools; needs the ``openenv`` extra).
"""
