"""miles sandbox-gateway: sandboxes for agent tool execution: local bubblewrap, Kubernetes pods and remote
providers behind one API, with limits, TTLs and quotas.
"""
