/* pdctl keys generate --out DIR [--nodes N]: the CURVE keypairs of a cluster (docs/cluster.md,
 * "Security"), for clusters made by hand, compose, Kubernetes; `pdctl cluster up` writes the same
 * layout into its run directory.
 *
 *   DIR/                 mode 0700
 *   DIR/router.key       the router's keypair (zcert format, mode 0600): --curve-secret-file
 *   DIR/router.pub       its public half (0644): the nodes' --router-public-key
 *   DIR/node-K.key       node K's keypair (0600), K = 0..N-1: a node's --curve-secret-file
 *   DIR/node-K.pub       its public half (0644)
 *   DIR/nodes.allow      every node's public key, one per line (0644): the router's and the
 *                        decode nodes' --curve-allow-file */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd/net.h"
#include "pdctl.h"

#define MAX_NODES 1024

pd_status pdctl_write_file(const char *path, const char *text, mode_t mode, pd_err *e) {
  char tmp[PATH_MAX + 96];
  if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid()) >= sizeof tmp)
    return pd_err_set(e, PD_ERANGE, "%s: path too long", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return pd_err_set(e, PD_EIO, "%s: %s", tmp, strerror(errno));
  size_t n = strlen(text), off = 0;
  while (off < n) {
    ssize_t w = write(fd, text + off, n - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int err = errno;
      close(fd);
      unlink(tmp);
      errno = err;
      return pd_err_set(e, PD_EIO, "%s: %s", tmp, strerror(err));
    }
    off += (size_t)w;
  }
  if (fchmod(fd, mode) != 0 || close(fd) != 0 || rename(tmp, path) != 0) {
    int err = errno;
    unlink(tmp);
    errno = err;
    return pd_err_set(e, PD_EIO, "%s: %s", path, strerror(err));
  }
  return PD_OK;
}

/* Generates one keypair into DIR/<name>.key and DIR/<name>.pub; its public key into pub. */
static pd_status write_pair(const char *dir, const char *name, char pub[PD_CURVE_Z85_LEN + 1],
                            pd_err *e) {
  pd_curve_keypair kp;
  char path[PATH_MAX + 64];
  pd_status st = pd_curve_keypair_generate(&kp, e);
  if (!st) {
    snprintf(path, sizeof path, "%s/%s.key", dir, name);
    st = pd_curve_keypair_save(path, &kp, true, e);
  }
  if (!st) {
    snprintf(path, sizeof path, "%s/%s.pub", dir, name);
    st = pd_curve_keypair_save(path, &kp, false, e);
  }
  if (!st) memcpy(pub, kp.public_z85, PD_CURVE_Z85_LEN + 1);
  memset(&kp, 0, sizeof kp);
  return st;
}

pd_status pdctl_keys_write(const char *dir, int n_nodes, pd_err *e) {
  if (n_nodes < 1 || n_nodes > MAX_NODES)
    return pd_err_set(e, PD_ERANGE, "--nodes must be in 1..%d", MAX_NODES);
  if (mkdir(dir, 0700) != 0 && errno != EEXIST)
    return pd_err_set(e, PD_EIO, "%s: %s", dir, strerror(errno));
  struct stat sb;
  if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return pd_err_set(e, PD_EIO, "%s: not a folder", dir);
  if ((sb.st_mode & 077) && chmod(dir, 0700) != 0) /* secrets: only the owner looks inside */
    return pd_err_set(e, PD_EIO, "%s: chmod 0700: %s", dir, strerror(errno));
  char pub[PD_CURVE_Z85_LEN + 1], name[32];
  pd_status st = write_pair(dir, "router", pub, e);
  if (st) return st;
  size_t cap = 128 + (size_t)n_nodes * 64, len = 0;
  char *allow = malloc(cap);
  if (!allow) return pd_err_set(e, PD_ENOMEM, "out of memory");
  len += (size_t)snprintf(allow + len, cap - len,
                          "# pdserve: the nodes' CURVE public keys (lines starting with # are "
                          "comments)\n");
  for (int k = 0; k < n_nodes && !st; k++) {
    snprintf(name, sizeof name, "node-%d", k);
    if (!(st = write_pair(dir, name, pub, e)))
      len += (size_t)snprintf(allow + len, cap - len, "# %s\n%s\n", name, pub);
  }
  char path[PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/nodes.allow", dir);
  if (!st) st = pdctl_write_file(path, allow, 0644, e);
  free(allow);
  return st;
}

int cmd_keys(int argc, char **argv) {
  const char *sub = argc > 2 ? argv[2] : NULL;
  if (!sub || strcmp(sub, "generate") != 0) {
    fputs("usage: pdctl keys generate --out DIR [--nodes N] [--force]\n"
          "  writes the CURVE keypairs of a cluster: router.key / router.pub, node-K.key /\n"
          "  node-K.pub for K = 0..N-1, nodes.allow ('pdctl keys generate --help')\n",
          stderr);
    return sub && (!strcmp(sub, "--help") || !strcmp(sub, "-h")) ? 0 : 2;
  }
  const char *out = NULL;
  int nodes = 2;
  bool force = false, help = false;
  pd_opt opts[] = {
      {"out", PD_OPT_STR, &out, "DIR", "the folder to write (created mode 0700)", NULL},
      {"nodes", PD_OPT_INT, &nodes, "N",
       "node keypairs node-0 .. node-<N-1> (default 2: a prefill and a decode node; nodes may "
       "share one)", NULL},
      {"force", PD_OPT_BOOL, &force, NULL, "replace the keys of a folder that has some", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 3, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl keys generate --out DIR [--nodes N] [--force]\n"
          "The router takes --curve-secret-file DIR/router.key --curve-allow-file "
          "DIR/nodes.allow;\na node --curve-secret-file DIR/node-K.key --router-public-key "
          "DIR/router.pub (a decode node\nalso --curve-allow-file DIR/nodes.allow). Secret "
          "files are mode 0600.\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!out) return pdctl_fail("keys generate needs --out DIR");
  char path[PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/router.key", out);
  if (!force && access(path, F_OK) == 0)
    return pdctl_fail("%s already holds keys; --force replaces them (every process of a cluster "
                      "that uses them must then get the new ones)", out);
  if (pdctl_keys_write(out, nodes, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  printf("wrote the keypairs of a router and %d node%s to %s (router.key, router.pub, node-0.key "
         "..., nodes.allow)\n", nodes, nodes == 1 ? "" : "s", out);
  return 0;
}
