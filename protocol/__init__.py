"""The OpenAI wire format, pure: endpoints, service tiers, request checks, response and
error shapes. A leaf: it imports nothing of ours and does no I/O, so the API, batch
validation and the engine worker all judge a request by the same rules.
"""
