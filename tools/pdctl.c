#include <stdio.h>
int main(void) { puts("pdctl"); return 0; }
