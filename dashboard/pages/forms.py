"""Forms of the dashboard pages. They only parse what was typed; the limits (memory, cpu, TTL,
env names, images, runtimes) are checked by the services, exactly as for the API."""

from __future__ import annotations

from collections.abc import Sequence

from django import forms
from django.conf import settings

# What the create form says a runtime's sandboxes cannot have, by capability.
LACKS = {"network": "no network", "checkpoint": "no checkpoint"}


def runtime_notes(caps: dict[str, bool]) -> list[str]:
    """What is said beside a runtime's name: what its sandboxes cannot have, and, for a runtime
    whose sandboxes are VMs (microvm), how they run: "KVM", or "emulated: no KVM" (QEMU's
    software emulation, seconds to boot rather than a fraction of one)."""
    notes = [words for key, words in LACKS.items() if not caps.get(key)]
    if caps.get("vm"):
        notes.append("KVM" if caps["kvm"] else "emulated: no KVM")
    return notes


class SandboxCreateForm(forms.Form):
    image = forms.CharField(max_length=128, widget=forms.Select)
    runtime = forms.CharField(max_length=32, widget=forms.Select)
    cpu = forms.FloatField(initial=1.0, widget=forms.NumberInput(attrs={"step": "0.1", "min": "0.1"}))
    memory_mb = forms.IntegerField(
        label="Memory (MB)", initial=512, widget=forms.NumberInput(attrs={"step": "64"})
    )
    disk_mb = forms.IntegerField(
        label="Disk (MB)", required=False,
        widget=forms.NumberInput(attrs={"step": "1024", "placeholder": "node default"}),
        help_text="holds every file it writes outside volumes",
    )  # fmt: skip
    timeout_s = forms.IntegerField(label="TTL (seconds)", initial=3600)
    on_expire = forms.ChoiceField(
        label="When the TTL runs out", initial="destroy", required=False,
        choices=[("destroy", "delete it"), ("pause", "pause it (files kept)")],
    )  # fmt: skip
    pause_mode = forms.ChoiceField(
        label="A pause keeps", initial="stop", required=False,
        choices=[("stop", "its files (processes end)"), ("checkpoint", "its processes and memory too")],
    )  # fmt: skip
    idle_timeout_s = forms.IntegerField(
        label="Pause when idle for (s)", required=False, min_value=10,
        widget=forms.NumberInput(attrs={"placeholder": "never", "min": "10"}),
    )  # fmt: skip
    egress = forms.ChoiceField(
        label="Network", initial="none", required=False,
        choices=[("none", "none (loopback only)"), ("allowlist", "only the hosts allowed"), ("all", "the internet")],
    )  # fmt: skip
    allow = forms.CharField(
        label="Allowed hosts", required=False,
        widget=forms.TextInput(attrs={"placeholder": "registry.npmjs.org:443 github.com 10.20.0.0/16",
                                      "spellcheck": "false", "autocapitalize": "none"}),
    )  # fmt: skip
    secrets = forms.MultipleChoiceField(
        required=False, widget=forms.CheckboxSelectMultiple,
        help_text="team secrets, set as environment variables of the same names",
    )  # fmt: skip
    env = forms.CharField(
        required=False,
        widget=forms.Textarea(
            attrs={"rows": 3, "placeholder": "KEY=VALUE, one a line", "spellcheck": "false"}
        ),
    )

    # Which field a service message is about, by how the message starts.
    _MESSAGE_FIELDS = (
        ("cpu", "cpu"),
        ("memory_mb", "memory_mb"),
        ("disk_mb", "disk_mb"),
        ("timeout_s", "timeout_s"),
        ("idle_timeout_s", "idle_timeout_s"),
        ("on_expire", "on_expire"),
        ("unknown pause mode", "pause_mode"),
        ("pause mode", "pause_mode"),
        ("an ephemeral sandbox", "pause_mode"),
        ("env", "env"),
        ("team ", "secrets"),
        ("network: allow", "allow"),
        ("network:", "egress"),
        ("unknown image", "image"),
        ("image", "image"),
        ("no online node runs runtime", "runtime"),
    )

    def __init__(self, *args: object, images: list[str], runtimes: dict[str, dict[str, bool]],
                 secrets: Sequence[str] = (), **kwargs: object) -> None:  # fmt: skip
        """``runtimes``: those the online nodes run, with their capabilities (none running: the
        default is offered, and the create says no node runs it)."""
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.fields["secrets"].choices = [(name, name) for name in secrets]  # type: ignore[attr-defined]
        self.images = images
        self.fields["image"].widget.choices = [(name, name) for name in images]
        default = settings.HANGAR_DEFAULT_RUNTIME
        # What each runtime's sandboxes cannot have, said beside its name.
        self.runtime_lacks = {name: runtime_notes(caps) for name, caps in runtimes.items()} or {default: []}
        self.fields["runtime"].widget.choices = [
            (name, f"{name} ({', '.join(lacks)})" if lacks else name)
            for name, lacks in self.runtime_lacks.items()
        ]
        if not self.is_bound:
            self.initial.setdefault(
                "runtime", default if default in self.runtime_lacks else next(iter(self.runtime_lacks))
            )

    def clean_env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for number, line in enumerate(self.cleaned_data.get("env", "").splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if "=" not in line:
                raise forms.ValidationError(f"line {number}: expected KEY=VALUE, got {line.strip()!r}")
            key, value = line.split("=", 1)
            env[key.strip()] = value
        return env

    def add_service_error(self, message: str) -> None:
        """Show a service's message next to the field it is about (or above the form)."""
        for prefix, field in self._MESSAGE_FIELDS:
            if message.startswith(prefix):
                self.add_error(field, message)
                return
        self.add_error(None, message)
