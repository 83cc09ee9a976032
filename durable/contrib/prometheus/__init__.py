"""Prometheus metrics for durable, driven by ``durable.signals``.

Enable it by adding ``"durable.contrib.prometheus"`` to ``INSTALLED_APPS``
(needs ``prometheus_client``: the ``[prometheus]`` extra). The metrics live in
``prometheus_client``'s default registry, so django-prometheus's ``/metrics``
view exports them; see the reference page "Metrics".
"""
