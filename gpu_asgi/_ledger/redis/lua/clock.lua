-- The time: the Redis server's, in milliseconds, so the hosts' clocks never matter.
local server_time = redis.call('TIME')
local now = tonumber(server_time[1]) * 1000 + math.floor(tonumber(server_time[2]) / 1000)

