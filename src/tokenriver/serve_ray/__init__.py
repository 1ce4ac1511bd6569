"""Data parallel serving on Ray Serve: engine replicas behind one OpenAI-compatible endpoint, with a prefix-aware
request router (optional extra: ray[serve])."""
