"""The fleet simulator: traces, node profiles, a discrete-event simulator that calls the real
routing code (profile, latency model, policies, router), a tuner and its report.

Nothing here imports fastapi, torch or onnxruntime; optuna and matplotlib are imported only
inside the tuner and the report.
"""
