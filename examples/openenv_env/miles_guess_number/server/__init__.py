"""The environment's server side: the Environment subclass and the FastAPI app OpenEnv builds around it."""
