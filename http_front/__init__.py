"""octoserve's OpenAI-compatible HTTP front (a process beside the router); see `app.py`."""
