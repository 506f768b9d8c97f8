"""miles engine: a CPU inference engine speaking SGLang's native HTTP protocol with a real radix prefix cache (the
stand-in for SGLang pods on machines without GPUs), and the tiny-model builder.
"""
