#!/bin/sh
# Run inside the Containerfile's stages (bind-mounted, never copied into a layer).
#   debian-packages.sh PACKAGE...   install the packages the base lacks (apt-get, no
#                                   recommends), then drop apt's lists; nothing when the
#                                   base has them all (the bases of `make image`)
#   debian-packages.sh --user       the image's user, twinmq (10001:10001), and its home
#                                   /var/lib/twinmq (the data volume's mount point)
set -eu
if [ "${1:-}" = --user ]; then
    echo 'twinmq:x:10001:10001:TwinMQ:/var/lib/twinmq:/usr/sbin/nologin' >> /etc/passwd
    echo 'twinmq:x:10001:' >> /etc/group
    mkdir -p /var/lib/twinmq
    chown 10001:10001 /var/lib/twinmq
    exit 0
fi
missing=""
for package in "$@"; do
    dpkg-query -W -f='${Status}\n' "$package" 2>/dev/null | grep -q 'ok installed' \
        || missing="$missing $package"
done
[ -z "$missing" ] && exit 0
echo "installing Debian packages:$missing"
export DEBIAN_FRONTEND=noninteractive
# Slim bases drop manual pages; the JRE's postinst still links one into man1.
mkdir -p /usr/share/man/man1
apt-get update -q
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $missing
apt-get clean
rm -rf /var/lib/apt/lists/*
