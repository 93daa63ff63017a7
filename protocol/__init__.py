"""The contract between swarmrl roles: wire schemas, identities, signatures, manifests and tasks.

Every role (node, coordinator, verifier, trainer) speaks to the others only through the types in this
package, over the network. It imports nothing else of the project, so that each role can be deployed,
audited and versioned on its own.
"""

PROTOCOL_VERSION = "swarmrl/2"
