"""miles session-server: per-session OpenAI chat endpoints and their TITO token buffers (Redis), the TITO
tokenizers and comparator, and conversion of a session into training samples.
"""
