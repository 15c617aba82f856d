#!/usr/bin/env bash
# The Debian packages lifecycle uses, installed by `make install` when missing (apt-get as root, else `sudo -n`).
# Today one: wordnet-base, the WordNet 3.0 database behind METEOR's synonyms (no PyPI package ships it).
# Where nothing can install it, this says so and exits 0: a run then scores METEOR without synonyms
# (gen_meteor_nosyn) and says so at its start (evaluate.meteor_synonyms: auto).
set -euo pipefail

WORDNET=${LIFECYCLE_WORDNET_DIR:-/usr/share/wordnet}/data.noun  # where METEOR looks (metrics_text.py)
PACKAGES=()
# the team stack and the two-node tests (deploy/stack.sh, tests/deploy/): PostgreSQL, an sshd and pdsh for DeepSpeed's
# hostfile launch, ip for the network namespaces (checked by path: the install's PATH may be bare)
compgen -G '/usr/lib/postgresql/*/bin/pg_ctl' > /dev/null || PACKAGES+=(postgresql)
[ -x /usr/sbin/sshd ] || PACKAGES+=(openssh-server)
[ -x /usr/bin/pdsh ] || PACKAGES+=(pdsh)
[ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || [ -x /bin/ip ] || PACKAGES+=(iproute2)
[ -f "$WORDNET" ] || PACKAGES+=(wordnet-base)
[ -f /usr/share/fonts/truetype/noto/NotoColorEmoji.ttf ] || PACKAGES+=(fonts-noto-color-emoji)  # corpus/build_images.py (the image corpus is committed: runs need no font)
[ ${#PACKAGES[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    SUDO=(none)
fi
if ! command -v apt-get >/dev/null || [ "${SUDO[0]:-}" = none ]; then
    echo "make install: Debian's ${PACKAGES[*]} is not installed and this user cannot install it" \
         "(needs apt-get as root or passwordless sudo): METEOR will be scored without WordNet synonyms" \
         "(gen_meteor_nosyn); to add them: sudo apt-get install ${PACKAGES[*]}" >&2
    exit 0
fi
echo "make install: installing Debian's ${PACKAGES[*]} (METEOR's WordNet synonyms)"
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" \
    2>&1 >/dev/null | { grep -v '^debconf: delaying' || true; } >&2
[ -f "$WORDNET" ] || { echo "make install: ${PACKAGES[*]} installed but $WORDNET is missing" >&2; exit 1; }
