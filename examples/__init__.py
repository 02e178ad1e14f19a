"""Runnable examples: the refund agent, the release saga, observed() on your own runner."""
