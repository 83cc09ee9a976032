from django.contrib import admin
from django.urls import include, path

from testproject.chat.views import start_turn

urlpatterns = [
    path("admin/", admin.site.urls),
    path("durable/schema/", include("durable.api.schema_urls")),
    path("durable/", include("durable.api.urls")),
    path("chat/turns/", start_turn),
]
