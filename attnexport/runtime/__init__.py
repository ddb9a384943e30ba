"""Runtime: kernel backends, host-side cache management, executors and the engine.

Heavy optional dependencies (onnxruntime, IPEX, xFormers) are imported only where used.
"""
