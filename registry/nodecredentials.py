"""Node-level registry credentials: what a node pulls with besides the pod's own pull secrets.

As on a node, these come after the pod's secrets and its ServiceAccount's: first the kubelet's
credential provider plugins (registry.credential_providers), then the static dockerconfigjson
of registry.credentials_file. Both files are read again when they change on disk (a mounted
Secret or ConfigMap updated in place), so rotated credentials need no restart.
"""
from archway.config import RegistrySettings
from archway.errors import CredentialProviderError

from .credentials import Keyring
from .filewatch import WatchedFile
from .providers import CredentialProviders


class NodeCredentials:
    def __init__(self, settings: RegistrySettings, *, keyring: Keyring | None = None,
                 providers: CredentialProviders | None = None):
        """`keyring` replaces registry.credentials_file (tests, embedding); `providers` replaces
        registry.credential_providers. A file that cannot be used raises ConfigError here."""
        self._fixed = keyring
        self._file = None
        if keyring is None and settings.credentials_file:
            self._file = WatchedFile(settings.credentials_file, Keyring.from_file,
                                     what="registry.credentials_file")
            self._file.get()
        self.providers = providers if providers is not None else \
            CredentialProviders.from_settings(settings.credential_providers)

    def file_keyring(self) -> Keyring:
        """registry.credentials_file as it is on disk now."""
        if self._file is not None:
            return self._file.get()
        return self._fixed if self._fixed is not None else Keyring.empty()

    def for_image(self, image: str) -> tuple[Keyring, tuple[CredentialProviderError, ...]]:
        """The node's credentials for `image` (a repository name): the plugins' first, then the
        file's; and the plugins that failed (their credentials are missing)."""
        if self.providers is None:
            return self.file_keyring(), ()
        provided, errors = self.providers.keyring_for(image)
        return provided.then(self.file_keyring()), errors
