/* Signals of a node process: SIGINT/SIGTERM ask the main loop to stop; crashes print a report. */
#include <signal.h>
#include <string.h>

#include "node.h"

/* ---- signals ---- */

volatile sig_atomic_t pd_node_stop_flag;

static void on_signal(int sig) {
  (void)sig;
  pd_node_stop_flag = 1;
}

void pd_node_install_signals(void) {
  pd_crash_handlers_install(pd_log_prog());
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
}
