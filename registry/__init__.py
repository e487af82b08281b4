"""Learn which CPU architectures a container or SIF image supports.

The modules stand on floors: each imports only from floors below its own (and from the core's
ground floor: archway.config, errors, hostport, logsafe, metrics), never sideways or up, so
there is no circle and each floor can be read, and tested, without the ones above it
(tests/test_rooms.py checks this table against the imports). A new module takes the floor above
the highest one it imports.

  9  inspect          `archway inspect IMAGE...`
  8  pacing           lookups paced per registry host
  8  resolver         cached, single-flight, concurrent lookups under one deadline
  7  reference        the kinds of image reference, keyed by scheme; parse_reference
  6  access           an image through its mirrors, with each credential a node would try
  5  oci              the OCI / Docker registry client
  4  auth             WWW-Authenticate challenges, bearer tokens, where credentials may go
  4  manifests        what a manifest means (pure)
  4  nodecredentials  the node's credentials: credentials file and provider plugins
  4  sifsources       SIF images over https:// and from a Sylabs library
  3  http             the one HTTP client: bounded in time and size, redirects by hand
  3  providers        credential provider plugins, cached as the kubelet caches them
  3  sharedlookups    one lookup for all the worker processes of a server
  2  cache            the answers, with their age, bounded in entries and bytes
  2  connections      connections that check where they landed and end at the deadline
  2  providerplugin   one run of a credential provider plugin
  2  records          what the cluster knows of an image: a record, its name, the store's calls
  1  credentials      keyrings from pull secrets and docker config files
  1  hostpolicy       which hosts archway may contact
  1  mirrors          hosts.toml, containerd's mirror configuration
  1  model            ImageInfo: what a resolution returns
  1  providerconfig   the kubelet's CredentialProviderConfig
  1  redirects        whether and how a redirect is followed (pure)
  1  sif              a SIF image's architecture, from its header
  0  backoff          per-host pause after a 429
  0  deadlines        a request's deadline, enforced on its sockets
  0  dns              name lookups that end at the caller's deadline
  0  filewatch        a file whose parsed content follows the disk
  0  imagematch       the kubelet's image-pattern rules
  0  imageref         an image reference as a value, and its three syntaxes
  0  lookuppool       the lookup threads, fair to hosts
  0  platforms        os/architecture/variant, normalised as containerd does
  0  proxy            the egress proxy a request goes through
  0  pushevents       a registry's push notifications: which tags may have moved
  0  trust            the CA bundles a verified connection trusts
"""
