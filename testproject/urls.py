from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("durable/schema/", include("durable.api.schema_urls")),
    path("durable/", include("durable.api.urls")),
]
