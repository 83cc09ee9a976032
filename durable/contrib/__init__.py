"""Optional integrations, each behind an extra (``pip install django-durable-workflows[prometheus]``)."""
