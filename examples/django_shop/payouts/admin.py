from django.contrib import admin

from examples.django_shop.payouts.models import LedgerLine, Payout

admin.site.register(Payout, list_display=("merchant", "slot", "amount_cents", "run_id",
                                          "fence_token"))
admin.site.register(LedgerLine, list_display=("merchant", "slot", "account", "delta_cents"))
