-- DeleteJob. Deletes every key of the job at once. Returns {status, num_groups_deleted}.
local num_groups = redis.call('HLEN', K_DATA)
redis.call('DEL', unpack(KEYS))
return {'OK', num_groups}
