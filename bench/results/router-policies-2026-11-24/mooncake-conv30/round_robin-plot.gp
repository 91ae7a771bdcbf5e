set terminal svg size 800,500
set grid
set key bottom right
set output 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-attainment.svg'
set xlabel 'request rate (req/s)'
set ylabel 'SLO attainment (%)'
set yrange [0:105]
set arrow from graph 0, first 90 to graph 1, first 90 nohead dt 2
plot 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-plot.dat' index 0 with linespoints title 'attainment'
unset arrow
set yrange [*:*]
set output 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-ttft.svg'
set xlabel 'TTFT (ms)'
set ylabel 'CDF'
plot 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-plot.dat' index 1 using 1:3 with lines title '0.70 req/s'
set output 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-tpot.svg'
set xlabel 'TPOT (ms)'
set ylabel 'CDF'
plot 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-plot.dat' index 1 using 2:3 with lines title '0.70 req/s'
set terminal pngcairo size 800,500
set grid
set key bottom right
set output 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-attainment.png'
set xlabel 'request rate (req/s)'
set ylabel 'SLO attainment (%)'
set yrange [0:105]
set arrow from graph 0, first 90 to graph 1, first 90 nohead dt 2
plot 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-plot.dat' index 0 with linespoints title 'attainment'
unset arrow
set yrange [*:*]
set output 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-ttft.png'
set xlabel 'TTFT (ms)'
set ylabel 'CDF'
plot 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-plot.dat' index 1 using 1:3 with lines title '0.70 req/s'
set output 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-tpot.png'
set xlabel 'TPOT (ms)'
set ylabel 'CDF'
plot 'bench/results/router-policies-2026-11-24/mooncake-conv30/round_robin-plot.dat' index 1 using 2:3 with lines title '0.70 req/s'
