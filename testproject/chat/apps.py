from django.apps import AppConfig


class ChatConfig(AppConfig):
    name = "testproject.chat"
    label = "chat"
