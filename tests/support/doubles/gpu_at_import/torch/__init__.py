"""TEST DOUBLE, not PyTorch: a ``torch`` that says CUDA was initialised at import.

Put on ``PYTHONPATH`` by tests/test_warm_pool.py to stand for a framework that creates a CUDA
context when imported (this machine has no GPU to do it for real). It answers
``torch.cuda.is_initialized()`` with ``True``, which is what
:func:`kernelmgr.warm.detect.framework_initialised` asks the real torch.
"""


class cuda:
    @staticmethod
    def is_initialized() -> bool:
        return True
