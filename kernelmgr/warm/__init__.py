"""Warm kernels: processes started ahead with the frameworks imported, handed a slice later.

:mod:`.detect` says whether a process has touched a GPU, :mod:`.worker` is what runs in a warm
process, :mod:`.settings` validates ``ElasticKernels.warm_pool`` and :mod:`.pool` keeps the
processes in the server.
"""
