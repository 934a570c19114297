# Sourced by the bench scripts. bundle_tree BUNDLE_DIR DIR: copies the bundle's pdctl, pd-router,
# pd-prefill and pd-decode into DIR as a build tree lays them out (tools/, router/,
# prefill-node/, decode-node/), where pdctl finds the node programs.
bundle_tree() {
  mkdir -p "$2/tools" "$2/router" "$2/prefill-node" "$2/decode-node" &&
    cp "$1/bin/pdctl" "$2/tools/" && cp "$1/bin/pd-router" "$2/router/" &&
    cp "$1/bin/pd-prefill" "$2/prefill-node/" && cp "$1/bin/pd-decode" "$2/decode-node/"
}
