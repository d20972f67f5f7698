from django.apps import AppConfig


class PayoutsConfig(AppConfig):
    name = "examples.django_shop.payouts"
    label = "payouts"
    default_auto_field = "django.db.models.BigAutoField"
