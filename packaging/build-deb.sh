#!/bin/bash
# Build bloomery_<version>_<arch>.deb from the working tree with dpkg-deb (docs/service.md).
#
#   packaging/build-deb.sh [--out DIR] [--python PY] [--no-deps] [--system-site-packages] [--wheels DIR]
#                          [--compress xz|gzip|none]
#
# The package carries:
#   /opt/bloomery/venv                      the application in a virtualenv (pip, from this tree)
#   /usr/bin/bloomery-serve, bloomery-broker   links into the venv
#   /usr/lib/bloomery/bloomery-need         the need hook (hooks/bloomery-need, run by the venv's python)
#   /lib/systemd/system/                    bloomery@.service, bloomery@.socket, bloomery-broker.service
#   /usr/lib/bloomery/backoff/              the restart back-off drop-ins (systemd >= 254) and their installer
#   /etc/bloomery/example.json              an example instance config (a conffile)
#   /usr/share/doc/bloomery/service.md
# postinst creates the static user and group bloomery, installs the back-off drop-ins where systemd
# knows their keys (again on a systemd upgrade: DEBIAN/triggers) and reloads systemd when it runs.
#
# --python PY: the venv's base interpreter (default /usr/bin/python3). The venv links to it,
#   so the target host needs the same interpreter at the same path: use the distribution's.
# --no-deps: install bloomery alone (fast). Its dependencies must then come from
#   --system-site-packages or be installed into /opt/bloomery/venv later.
# --wheels DIR: install from the wheels in DIR only (an offline build).
# --compress: dpkg-deb's compressor (default xz; none builds fastest, for tests).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$REPO/dist
PY=/usr/bin/python3
NO_DEPS=0
SYSTEM_SITE=0
WHEELS=
COMPRESS=xz
PREFIX=/opt/bloomery
VENV=$PREFIX/venv

die() { echo "build-deb: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --python) PY=$2; shift 2 ;;
        --no-deps) NO_DEPS=1; shift ;;
        --system-site-packages) SYSTEM_SITE=1; shift ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --compress) COMPRESS=$2; shift 2 ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

case "$COMPRESS" in xz|gzip|none) ;; *) die "--compress $COMPRESS: one of xz, gzip, none" ;; esac
command -v dpkg-deb >/dev/null || die "dpkg-deb not found (apt-get install dpkg)"
[ -x "$PY" ] || die "--python $PY: not an executable interpreter"
PY_MM=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$("$PY" -c 'import sys; print(sys.version_info >= (3, 11))')" = True ] || die "--python $PY is $PY_MM; bloomery needs >= 3.11"
case "$PY" in
    /usr/bin/*) ;;
    *) echo "build-deb: warning: the venv links to $PY; a host without that path cannot run the package" >&2 ;;
esac
PIP_PY=${BLOOMERY_PIP_PYTHON:-python3}   # the interpreter whose pip installs into the venv (pip --python)
"$PIP_PY" -m pip --version >/dev/null 2>&1 || die "no pip for $PIP_PY (set BLOOMERY_PIP_PYTHON to a python with pip >= 22.3)"

VERSION=$("$PIP_PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$REPO/pyproject.toml")
ARCH=$(dpkg --print-architecture)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/bloomery-deb.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/root

# 1. the sources: what git tracks or would track (the tree as it is now), else the folder as is;
#    not the tests and tools (the goldens are large, and the wheel takes neither)
mkdir -p "$WORK/src"
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$REPO" && git ls-files -co --exclude-standard -z -- . ':!tests' ':!tools' ':!dist' \
        | tar --null -T - -cf -) | tar -xf - -C "$WORK/src"
    # the prebuilt kernels are build output git ignores; fresh ones spare the wheel's nvcc step (setup.py)
    PREBUILT=bloomery/engine/cuda/prebuilt
    if [ -d "$REPO/$PREBUILT" ]; then
        mkdir -p "$WORK/src/$PREBUILT" && cp -pR "$REPO/$PREBUILT"/. "$WORK/src/$PREBUILT/"
    fi
else
    (cd "$REPO" && tar --exclude=__pycache__ --exclude=./tests --exclude=./tools --exclude=./dist --exclude=./build \
        --exclude=./.git -cf - .) | tar -xf - -C "$WORK/src"
fi

# 2. the venv, built in place under the staging root, then made to name its final path
venv_flags=(--without-pip)
[ "$SYSTEM_SITE" = 1 ] && venv_flags+=(--system-site-packages)
"$PY" -m venv "${venv_flags[@]}" "$ROOT$VENV"
pip_flags=(--no-compile --disable-pip-version-check --no-warn-script-location -q)
[ "$NO_DEPS" = 1 ] && pip_flags+=(--no-deps)
[ -n "$WHEELS" ] && pip_flags+=(--no-index --find-links "$WHEELS")
"$PIP_PY" -m pip wheel -q --no-deps --disable-pip-version-check -w "$WORK/wheel" "$WORK/src" >&2
# the caller's PYTHONPATH (a source tree, its bloomery.egg-info) would make pip call bloomery installed
(cd "$WORK" && env -u PYTHONPATH "$PIP_PY" -m pip --python "$ROOT$VENV/bin/python" install "${pip_flags[@]}" \
    "$WORK"/wheel/bloomery-*.whl >&2)
for script in bloomery-serve bloomery-broker; do
    [ -x "$ROOT$VENV/bin/$script" ] || die "the wheel installs no '$script' console script ([project.scripts] in pyproject.toml)"
done
rm -f "$ROOT$VENV"/lib/python*/site-packages/bloomery-*.dist-info/direct_url.json   # names the build folder
# shebangs, activate scripts and pyvenv.cfg name the staging path: rewrite it to the installed one
grep -rlIF "$ROOT" "$ROOT$VENV/bin" "$ROOT$VENV/pyvenv.cfg" | while read -r f; do
    sed -i "s#$ROOT##g" "$f"
done
! grep -rqIF "$ROOT" "$ROOT$VENV/bin" "$ROOT$VENV/pyvenv.cfg" || die "the staging path is still named in the venv"
# byte-code now (ProtectSystem=strict makes /opt read-only at run time), naming the installed paths
"$ROOT$VENV/bin/python" -m compileall -q -j0 -s "$ROOT" -p / "$ROOT$VENV/lib" >/dev/null

# 3. the rest of the tree
install -d "$ROOT/usr/bin" "$ROOT/usr/lib/bloomery" "$ROOT/lib/systemd/system" "$ROOT/etc/bloomery" \
    "$ROOT/usr/share/doc/bloomery"
for script in bloomery-serve bloomery-broker; do
    ln -s "../..$VENV/bin/$script" "$ROOT/usr/bin/$script"     # relative: also right inside a scratch root
done
[ -f "$REPO/hooks/bloomery-need" ] || die "hooks/bloomery-need is missing"
{ echo "#!$VENV/bin/python"; tail -n +2 "$REPO/hooks/bloomery-need"; } > "$ROOT/usr/lib/bloomery/bloomery-need"
chmod 0755 "$ROOT/usr/lib/bloomery/bloomery-need"
[ -f "$REPO/hooks/README.md" ] && install -m 0644 "$REPO/hooks/README.md" "$ROOT/usr/share/doc/bloomery/hooks.md"
for unit in bloomery@.service bloomery@.socket bloomery-broker.service; do
    install -m 0644 "$REPO/units/$unit" "$ROOT/lib/systemd/system/$unit"
done
for unit in bloomery@.service bloomery-broker.service; do
    install -D -m 0644 "$REPO/units/backoff/$unit.d/backoff.conf" "$ROOT/usr/lib/bloomery/backoff/$unit.d/backoff.conf"
done
install -m 0755 "$REPO/units/backoff/install" "$ROOT/usr/lib/bloomery/backoff/install"
install -m 0644 "$REPO/packaging/example.json" "$ROOT/etc/bloomery/example.json"
install -m 0644 "$REPO/docs/service.md" "$ROOT/usr/share/doc/bloomery/service.md"

# 4. the control files
install -d "$ROOT/DEBIAN"
install -m 0755 "$REPO/packaging/debian/postinst" "$REPO/packaging/debian/prerm" "$REPO/packaging/debian/postrm" \
    "$ROOT/DEBIAN/"
install -m 0644 "$REPO/packaging/debian/triggers" "$ROOT/DEBIAN/triggers"
echo /etc/bloomery/example.json > "$ROOT/DEBIAN/conffiles"
SIZE_KB=$(du -sk --exclude=DEBIAN "$ROOT" | cut -f1)
DEPENDS="python$PY_MM, adduser"
cat > "$ROOT/DEBIAN/control" <<EOF
Package: bloomery
Version: $VERSION
Architecture: $ARCH
Maintainer: bloomery developers <bloomery@localhost>
Installed-Size: $SIZE_KB
Depends: $DEPENDS
Section: net
Priority: optional
Description: drop-in llama-server for mixture-of-experts models
 bloomery-serve answers llama.cpp's llama-server HTTP API on the same GGUF
 files and flags. This package runs it under systemd: one bloomery@NAME unit
 per model (/etc/bloomery/NAME.json), socket activation, and a host broker
 that queues starts until their memory fits.
EOF

mkdir -p "$OUT"
DEB=$OUT/bloomery_${VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group "-Z$COMPRESS" --build "$ROOT" "$DEB" >&2
echo "$DEB"
